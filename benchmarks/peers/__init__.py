"""iterserve against other engines (llama.cpp's llama-server, vLLM): the library of vs_peers.py and
peer_matrix.py, kept out of the package because no iterserve command compares with peers.

systems.py starts and stops the servers; vs_peers.py holds the comparison's plan, metrics and table;
vllm_bench.py drives vLLM's own client; matrix.py the models x shapes x concurrency matrix. Scripts
import it as `peers` (their folder is first on sys.path), the tests likewise (pyproject's pytest
pythonpath).
"""
