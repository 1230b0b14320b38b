"""Several nodes as one fleet: request balancing over Ratio1's ChainStore (protocol.py: the wire format
upstream's inference plugins share; balancer.py: the origin's side, executor.py the executor's; peer_choice.py
and store_link.py beside them)."""
