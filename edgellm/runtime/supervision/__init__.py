"""The engine worker's life: the worker process itself, its supervisor (`WorkerEngine`, the API's engine
client), several models behind one client (`ModelSwitch`), the pipe between them, the pre-start probe, and the
guards that turn a native crash into a request's error instead of a dead node. (The third engine client,
`OfflineEngine`, runs the engine in the calling process for the batch tools and lives in `edgellm/offline.py`,
a floor below, where those tools can import it.)"""
