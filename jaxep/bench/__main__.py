from jaxep.bench import console_main

console_main()
