"""The fuzz harness, by format: `gguf_file` and `hf_directory` damage model files (seeded, from
small fixtures), `run` loads each case under a watchdog and counts the outcomes (the long run:
`python -m tests.fuzz --cases 10000`), `http_body` makes fuzzed request bodies for the server;
`common` holds what they share."""
