// src/cli/main.cpp, unchanged, with its `main` renamed so fuzz_cli.cpp can call it per input.
#define main trainmem_cli_main
#include "cli/main.cpp"
