"""Developer tools: the private PostgreSQL cluster of the demo and the tests."""
