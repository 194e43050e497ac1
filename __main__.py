from decodert.cli import main

raise SystemExit(main())
