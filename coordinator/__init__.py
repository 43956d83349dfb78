"""The coordinator: the public Generate API, running rounds between draft and target."""
