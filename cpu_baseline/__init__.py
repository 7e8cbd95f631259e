"""The remote-scoring architecture: CPU inverted index, CPU scorer, scoring service, index host, remote
retriever, the CPU engine; `lab/` holds the superseded CPU scorer versions."""
