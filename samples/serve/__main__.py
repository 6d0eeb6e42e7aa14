from samples.serve.launch import main

main()
