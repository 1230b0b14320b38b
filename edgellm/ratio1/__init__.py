"""Running this repo's plugins inside a real Ratio1 (naeural-core) edge node: the node launcher behind
`edgellm ratio1-node` and the Ratio1 tests. Not the native host (that is edgellm/runtime/)."""
