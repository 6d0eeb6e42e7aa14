from samples.serve.server import main

main()
