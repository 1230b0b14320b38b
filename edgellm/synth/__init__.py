"""Schema-driven synthetic data generation against an edgellm (or Ratio1) node.

`generator.generate` is the core (used by `edgellm synth` and by the Ratio1 plugin's bridge);
`schema` loads and checks schemas; `journal` makes a run resumable. Nothing is imported here, so
that `edgellm serve` does not pay for jsonschema.
"""
