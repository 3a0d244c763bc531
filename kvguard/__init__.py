"""kvguard: KV-cache integrity guard for paged LLM serving."""
