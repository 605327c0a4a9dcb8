"""Sessions' shared resources: adapter ids, the executor, each session's context."""
