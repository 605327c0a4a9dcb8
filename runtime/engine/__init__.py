"""Engine and Session: what users call."""
