"""The benchmarks: one script per measurement, run from the repo root as a file,

    python tools/bench/<name>.py [--help]     (on a shared machine: flock /tmp/edgellm-cpu.lock ...)

and each measured against a baseline in the same run (docs/benchmarks.md holds every result and the command
that made it). What they share is here, one concept a module:

  servers.py   the servers under measurement: an edgellm node, llama-server (tools/llama_server_build.sh),
               free ports, process trees and their memory, stopping everything on Ctrl-C (run_main)
  results.py   percentiles, A-B-A turns and ratios against the in-run baseline, markdown tables, results files
  prompts.py   the texts several benchmarks send, so their numbers compare

The scripts:

  throughput.py       the node over HTTP vs llama-cpp-python's serial API (`make bench`)
  vs_llama_server.py  edgellm vs llama.cpp's llama-server, in turns: chat and schema-guided JSON
  lanes.py            priorities and KV layouts under load, against llama-server
  schemas.py          guided JSON on the corpus of real-world schemas, optionally against llama-server
  tool_calls.py       tool calling: throughput, guide cost, call validity
  batch.py            `edgellm batch-run` against a node
  infer.py            `edgellm infer` (in-process) vs the serial API
  embeddings.py       the engine's embeddings vs create_embedding; chat beside embeddings
  models.py           several models on one node: switches, idle unload
  fleet.py            request balancing between two Ratio1 nodes
  ratio1.py           the native host vs a Ratio1 node serving the same engine
  console.py          what the console page costs
  contention.py       the adaptive thread policy beside a busy process
  multimodal.py       images inside the continuous batch
  prefix_cache.py     time to first token behind a saved prefix
  samples.py          n samples in one request vs n requests
  speculative.py      prompt-lookup drafts vs none
  json_closing.py     JSON closed inside max_tokens
"""
