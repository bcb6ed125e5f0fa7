from mlxlocal.cli import main

main()
