"""edgellm.batch."""
