"""The ``transformers`` model written into exported folders (``export-hf``) for the schemes
``transformers`` has no class for; loaded with ``trust_remote_code=True``. Both files import
only torch and transformers, never this project: they travel alone."""
