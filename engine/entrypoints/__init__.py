"""Ways into the engine from outside the process: the OpenAI-compatible HTTP server (`openai/`)."""
