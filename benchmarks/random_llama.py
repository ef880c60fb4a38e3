"""Runs iterserve.bench.random_llama (see its --help). The code lives in the package so that the tests
import it without reaching into this folder."""
from iterserve.bench.random_llama import main

if __name__ == "__main__":
    main()
