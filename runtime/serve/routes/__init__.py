"""The endpoints, one module per family: generation (completions and chat), models,
adapters (load and unload), and operations (health and metrics)."""
