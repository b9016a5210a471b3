from tts_service.cli import main

raise SystemExit(main())
