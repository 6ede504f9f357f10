from fleetwise.cli import main

raise SystemExit(main())
