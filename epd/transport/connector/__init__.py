"""The vLLM plugins, loaded by module path in every engine process: the EC connector
(:mod:`.ec_connector`, with its producer and consumer halves, its config and the
``ec_transfer_params`` format) and the KV connector (:mod:`.kv_connector`)."""
