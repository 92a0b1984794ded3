"""Integrations of flashgen with other libraries, imported only on request."""
