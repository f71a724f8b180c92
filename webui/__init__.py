"""kvscope's web UI: the engine host, input parsing, and one module per tab group (app.py assembles them)."""
