"""server — see ARCHITECTURE in README.md."""
