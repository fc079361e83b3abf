"""Running compiled artifacts (imports TVM's runtime only, never its compiler)."""
