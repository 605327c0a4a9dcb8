"""Issue 53 item 4, "Open at once": where a model open goes, and the routes to open less (RESULTS.md)."""
