from pdwire.cli import main

raise SystemExit(main())
