"""The `kvscope` command line (kvscope/cli.py): `kvscope serve`, `kvscope app`, `kvscope bench`."""
