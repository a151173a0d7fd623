"""Gateway: the public GatewayService, stage routing and token streaming."""
