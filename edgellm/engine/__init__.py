"""edgellm.engine."""
