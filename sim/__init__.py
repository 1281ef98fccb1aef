"""sim — see ARCHITECTURE in README.md."""
