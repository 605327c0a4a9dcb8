"""Running the model: the only layer that imports ai-edge-litert's interpreter API."""
