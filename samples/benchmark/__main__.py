from samples.benchmark.cli import main

main()
