"""Chat: templates in a jinja2 sandbox, sessions over their own cache row, incremental detokenizing and stop strings."""
