"""OpenAI-style files and batches, kept in NATS and run on the fleet (docs/architecture.md)."""
