"""ledger — see ARCHITECTURE in README.md."""
