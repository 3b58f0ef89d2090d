"""The training loop and what only it uses: optimizer, start point, validation, diagnostics."""
