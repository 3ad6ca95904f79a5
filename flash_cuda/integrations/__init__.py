"""Adapters that plug flash_cuda into other libraries' attention entry points."""
