"""`pippin bench`: a load generator for any OpenAI-compatible server."""
