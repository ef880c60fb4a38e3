"""Runs iterserve.bench.gpu_equality (see its --help). The code lives in the package so that the tests
import it without reaching into this folder."""
from iterserve.bench.gpu_equality import main

if __name__ == "__main__":
    main()
