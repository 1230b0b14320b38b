"""Several nodes as one fleet: request balancing over Ratio1's ChainStore (protocol.py: the wire
format upstream's inference plugins share; balancer.py: the delegating and executing side)."""
