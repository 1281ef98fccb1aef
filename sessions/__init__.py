"""sessions — see ARCHITECTURE in README.md."""
