"""`python -m samples.bench_runtime`: the runtime benchmark (samples/microbench/runtime.py) under the
name the README and the serving benchmark use."""
from samples.microbench.runtime import main

if __name__ == "__main__":
    main()
