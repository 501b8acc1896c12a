"""The YAML schemas of pdwire's wire protocols (package data; see README.md here)."""
