"""Verifiable tasks: each module makes records ``{"prompt", "answer"}`` and scores completions."""
