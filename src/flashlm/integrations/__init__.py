"""Integrations with the Hugging Face stack."""
