from tts_service.entry import main

raise SystemExit(main())
