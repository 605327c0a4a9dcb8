"""llama.cpp beside the runtime: its virtualenv set-up, model files and the child process that runs it."""
