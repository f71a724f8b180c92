"""`python -m kvscope ...`, the same as the `kvscope` command."""
from kvscope.cli import main

if __name__ == "__main__":
    main()
