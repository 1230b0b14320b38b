"""`edgellm pull`: models fetched and verified before the node needs them (the node never downloads).

sources.py turns a spec into files and a folder, hf_cache.py finds a file the Hugging Face cache already
holds, fetch.py downloads one resumably and checks it, cli.py is the command."""
