// Command epd-gateway is EPD's public gateway, compiled: GatewayService (Generate, Abort) in
// front of encoder, prefill and decode instances, for the epd (E/P/D) and epd-combined (E+PD)
// modes. It takes the flags of `epd gateway`, which starts it for `--impl go`; the monolithic
// oracle and the OpenAI-compatible HTTP front stay in the Python gateway.
//
// Lifecycle, as every EPD service: listen (liveness SERVING, readiness NOT_SERVING), print
// EPD_LISTENING with the ports, then readiness follows the stages: SERVING while every stage it
// needs has a live instance. On SIGTERM or SIGINT: NOT_SERVING first, then stop accepting and
// let streams finish for --drain-grace-s.
package main

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"runtime/debug"
	"strconv"
	"strings"
	"syscall"
	"time"

	epdv1 "epd/sdk/go/epd/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/reflect/protoreflect"
)

const maxMessageBytes = 64 * 1024 * 1024 // as every EPD service: inline embeddings and media must fit

// trailersFlushWindow: at the end of a drain, how long the last calls' statuses may take to be
// written before the connections are closed.
const trailersFlushWindow = time.Second

type stringList []string

func (l *stringList) String() string     { return strings.Join(*l, ",") }
func (l *stringList) Set(v string) error { *l = append(*l, v); return nil }

type config struct {
	host, mode, tlsCert, tlsKey, tlsCA, authTokenFile, affinityKeyFile, otlpEndpoint string
	port, metricsPort, maxPromptBytes, maxAttempts                                   int
	requireClientCert, forwardMedia, affinityRouting, localPrefillFallback           bool
	drainGrace, retryBackoff                                                         time.Duration
	limits                                                                           mediaLimits
	encoders, prefills, decodes                                                      stringList
}

func parseFlags() *config {
	c := &config{}
	var drainGrace, retryBackoff float64
	var maxItemBytes, maxRequestBytes int64
	flag.StringVar(&c.host, "host", "127.0.0.1", "address to bind (0.0.0.0 inside a pod)")
	flag.IntVar(&c.port, "port", 0, "gRPC port; 0 picks a free one and prints it")
	flag.IntVar(&c.metricsPort, "metrics-port", -1, "serve Prometheus /metrics on this port (0: a free one; -1: off)")
	flag.StringVar(&c.otlpEndpoint, "otlp-endpoint", "", "export traces over OTLP/gRPC to this endpoint")
	flag.Float64Var(&drainGrace, "drain-grace-s", 5, "on SIGTERM, how long in-flight calls may finish")
	flag.StringVar(&c.tlsCert, "tls-cert", "", "this service's certificate chain (PEM)")
	flag.StringVar(&c.tlsKey, "tls-key", "", "its private key (PEM)")
	flag.StringVar(&c.tlsCA, "tls-ca", "", "the CA that signs peers: stages are dialled over TLS with it, and client certificates checked")
	flag.BoolVar(&c.requireClientCert, "require-client-cert", false, "refuse clients without a certificate signed by --tls-ca")
	flag.StringVar(&c.mode, "mode", "epd", "epd (E/P/D) or epd-combined (E+PD)")
	flag.Var(&c.encoders, "encoder", "encoder: host:port, or dns:///name:port (repeat for several)")
	flag.Var(&c.prefills, "prefill", "prefill: host:port, or dns:///name:port (repeat for several)")
	flag.Var(&c.decodes, "decode", "decode: host:port, or dns:///name:port (repeat for several)")
	flag.BoolVar(&c.forwardMedia, "forward-media", false, "benchmarks' baseline: also send every item's media to prefill and decode")
	flag.IntVar(&c.maxAttempts, "max-attempts", 3, "tries per request before its first token, the first included")
	flag.Float64Var(&retryBackoff, "retry-backoff-s", 0.05, "back-off before the second try; doubles per try, with full jitter")
	flag.IntVar(&c.maxPromptBytes, "max-prompt-bytes", 1024*1024, "text of one chat, in bytes (0: no limit)")
	flag.BoolVar(&c.affinityRouting, "affinity-routing", true, "route items and prompt prefixes to the instance whose cache may hold them")
	flag.StringVar(&c.affinityKeyFile, "affinity-key-file", "", "secret that keys item routing; gateway replicas that share it route an item alike")
	flag.BoolVar(&c.localPrefillFallback, "local-prefill-fallback", false, "with no live prefill instance, decode instances prefill (E+PD)")
	flag.StringVar(&c.authTokenFile, "auth-token-file", "", "require 'authorization: Bearer <token>' (the file's content) on every call but health and reflection")
	flag.Int64Var(&maxItemBytes, "max-item-bytes", 32*1024*1024, "bytes of one media item")
	flag.Int64Var(&maxRequestBytes, "max-request-bytes", 64*1024*1024, "bytes of all media of one request")
	flag.Parse()
	if flag.NArg() > 0 {
		fail("unexpected arguments: %v", flag.Args())
	}
	c.drainGrace = time.Duration(drainGrace * float64(time.Second))
	c.retryBackoff = time.Duration(retryBackoff * float64(time.Second))
	c.limits = mediaLimits{maxItemBytes: maxItemBytes, maxRequestBytes: maxRequestBytes}
	if (c.tlsCert == "") != (c.tlsKey == "") {
		fail("--tls-cert and --tls-key go together")
	}
	if c.requireClientCert && (c.tlsCert == "" || c.tlsCA == "") {
		fail("--require-client-cert needs --tls-cert, --tls-key and --tls-ca (the CA that signs client certificates)")
	}
	if c.maxAttempts < 1 {
		fail("--max-attempts must be at least 1")
	}
	return c
}

func fail(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "epd-gateway: "+format+"\n", args...)
	os.Exit(2)
}

// gcPercent: the gateway's live heap is small (a few MiB) and what it allocates is mostly media
// passing through, so collecting at 4x the live heap rather than Go's 2x halves the time spent in
// the collector per request (bench/gateway_overhead.py) for a few more MiB. GOGC overrides it.
const gcPercent = 400

func main() {
	log.SetFlags(log.Ldate | log.Ltime | log.Lmicroseconds)
	if os.Getenv("GOGC") == "" {
		debug.SetGCPercent(gcPercent)
	}
	c := parseFlags()
	if err := serve(c); err != nil {
		log.Printf("ERROR %v", err)
		os.Exit(1)
	}
}

func serve(c *config) error {
	var m = newMetrics()
	p, err := newPipeline(c, m)
	if err != nil {
		return err
	}
	serverOptions := []grpc.ServerOption{
		grpc.MaxRecvMsgSize(maxMessageBytes), grpc.MaxSendMsgSize(maxMessageBytes),
		// Accept client keepalive pings as often as every 10 s, even between calls, so idle
		// connections through meshes and NATs stay open.
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second, PermitWithoutStream: true}),
	}
	transport := "plaintext"
	if c.tlsCert != "" {
		config, err := serverTLS(c)
		if err != nil {
			return err
		}
		serverOptions = append(serverOptions, grpc.Creds(credentials.NewTLS(config)))
		transport = map[bool]string{true: "mTLS", false: "TLS"}[c.requireClientCert]
	}
	if c.authTokenFile != "" {
		token, err := readToken(c.authTokenFile)
		if err != nil {
			return err // read before listening: a missing or empty token file stops the gateway at start
		}
		auth := bearerToken{expected: []byte("Bearer " + token)}
		serverOptions = append(serverOptions, grpc.ChainUnaryInterceptor(auth.unary), grpc.ChainStreamInterceptor(auth.stream),
			// Unknown methods are refused the same way, so an unauthenticated peer learns nothing
			// about which methods exist.
			grpc.UnknownServiceHandler(func(_ interface{}, stream grpc.ServerStream) error {
				method, _ := grpc.MethodFromServerStream(stream)
				if err := auth.check(stream.Context(), method); err != nil {
					return err
				}
				return status.Errorf(codes.Unimplemented, "unknown method %s", method)
			}))
	}
	traces, err := newExporter(c.otlpEndpoint)
	if err != nil {
		return err
	}
	defer traces.close()
	server := grpc.NewServer(serverOptions...)
	servicer := &gatewayServicer{pipeline: p, metrics: m, traces: traces, inFlight: map[string]*run{}, calls: newCallCount()}
	epdv1.RegisterGatewayServiceServer(server, servicer)
	healthServer := health.NewServer()
	healthpb.RegisterHealthServer(server, healthServer)
	registerReflection(server)
	readiness := serviceName(epdv1.File_epd_v1_gateway_proto, "GatewayService")
	healthServer.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	healthServer.SetServingStatus(readiness, healthpb.HealthCheckResponse_NOT_SERVING)

	listener, err := net.Listen("tcp", net.JoinHostPort(c.host, strconv.Itoa(c.port)))
	if err != nil {
		return err
	}
	metricsPort, err := serveMetrics(c, m)
	if err != nil {
		return err
	}
	draining := make(chan struct{})
	followStages := func() {
		select {
		case <-draining:
			return
		default:
		}
		serving := p.encoders.available() && p.decodes.available()
		if p.prefills != nil && !c.localPrefillFallback {
			serving = serving && p.prefills.available()
		}
		healthServer.SetServingStatus(readiness, map[bool]healthpb.HealthCheckResponse_ServingStatus{
			true: healthpb.HealthCheckResponse_SERVING, false: healthpb.HealthCheckResponse_NOT_SERVING}[serving])
	}
	for _, stagePool := range p.pools() {
		stagePool.onAvailabilityChange = followStages
	}
	followStages()

	announce := map[string]interface{}{"service": "gateway", "port": listener.Addr().(*net.TCPAddr).Port, "metrics_port": metricsPort}
	line, _ := json.Marshal(announce)
	fmt.Printf("EPD_LISTENING %s\n", line) // launchers (epd up, tests) read the ephemeral ports here
	log.Printf("INFO gateway (compiled, %s) listening on %s, %s", c.mode, listener.Addr(), transport)
	fmt.Printf("EPD_READY %s\n", `{"service": "gateway"}`)

	stop := make(chan os.Signal, 2)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	go exitWithLauncher()
	served := make(chan error, 1)
	go func() { served <- server.Serve(listener) }()
	select {
	case err := <-served:
		return err
	case <-stop:
	}
	// Drain: readiness off first (load balancers and sidecars stop routing here), then stop
	// accepting and let streams finish.
	close(draining)
	healthServer.Shutdown()
	stopped := make(chan struct{})
	go func() { server.GracefulStop(); close(stopped) }() // no new connections or calls from here on
	// grpc-go 1.33's GracefulStop also waits for clients to close their connections, which a
	// client holding a channel open never does: wait for the calls instead.
	drained := make(chan struct{})
	go func() { servicer.calls.wait(); close(drained) }()
	select {
	case <-drained:
	case <-time.After(c.drainGrace):
		log.Printf("WARNING calls still running after --drain-grace-s %s; closing them", c.drainGrace)
	}
	// A call's status is queued, not yet written, when its handler returns, and Stop drops what
	// is queued: the client would see its stream cut ("Socket closed") instead of its trailers.
	// GracefulStop may finish meanwhile (every client closed its connection); else wait a moment.
	select {
	case <-stopped:
	case <-time.After(trailersFlushWindow):
	}
	server.Stop()
	for _, stagePool := range p.pools() {
		stagePool.close()
	}
	log.Printf("INFO gateway stopped")
	return nil
}

func newPipeline(c *config, m *metrics) (*pipeline, error) {
	keys, err := newAffinityKeys(c.affinityKeyFile)
	if err != nil {
		return nil, err
	}
	dial, err := stageDialer(c)
	if err != nil {
		return nil, err
	}
	p := &pipeline{
		limits: c.limits, maxPromptBytes: c.maxPromptBytes, forwardMedia: c.forwardMedia, localPrefillFallback: c.localPrefillFallback,
		retry: retryPolicy{maxAttempts: c.maxAttempts, backoff: c.retryBackoff}, keys: keys, metrics: m,
	}
	stagePool := func(stage, service string, targets []string) (*pool, error) {
		return newPool(stage, service, targets, dial, c.affinityRouting, m)
	}
	switch c.mode {
	case "epd":
		if p.prefills, err = stagePool("prefill", serviceName(epdv1.File_epd_v1_prefill_proto, "PrefillService"), c.prefills); err != nil {
			return nil, err
		}
	case "epd-combined":
	default:
		return nil, fmt.Errorf("--mode %s: the compiled gateway serves epd and epd-combined (monolithic runs in the Python gateway)", c.mode)
	}
	if p.encoders, err = stagePool("encoder", serviceName(epdv1.File_epd_v1_encoder_proto, "EncoderService"), c.encoders); err != nil {
		return nil, err
	}
	if p.decodes, err = stagePool("decode", serviceName(epdv1.File_epd_v1_decode_proto, "DecodeService"), c.decodes); err != nil {
		return nil, err
	}
	if c.affinityRouting && c.affinityKeyFile == "" {
		log.Printf("INFO routing keys are this process's own: gateway replicas route an item to one encoder only when they share --affinity-key-file")
	}
	return p, nil
}

func (p *pipeline) pools() []*pool {
	if p.prefills == nil {
		return []*pool{p.encoders, p.decodes}
	}
	return []*pool{p.encoders, p.prefills, p.decodes}
}

// stageDialer: how stages are dialled. gRPC's default reconnect backoff grows to 120 s, and a
// restarted instance would stay unreachable for minutes; instances come back in seconds.
// Keepalive pings every 30 s (above the servers' 10 s floor) find dead peers.
func stageDialer(c *config) (dialFunc, error) {
	options := []grpc.DialOption{
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxMessageBytes), grpc.MaxCallSendMsgSize(maxMessageBytes)),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: 30 * time.Second, Timeout: 10 * time.Second, PermitWithoutStream: true}),
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second},
			MinConnectTimeout: 20 * time.Second,
		}),
	}
	if c.tlsCA == "" {
		if c.tlsCert != "" {
			log.Printf("WARNING --tls-cert without --tls-ca: stages are dialled in PLAINTEXT (give --tls-ca to dial them over TLS)")
		}
		return func(address, _ string) (*grpc.ClientConn, error) {
			return grpc.Dial(address, append(options, grpc.WithInsecure())...)
		}, nil
	}
	roots, err := readPool(c.tlsCA)
	if err != nil {
		return nil, err
	}
	base := &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}
	if c.tlsCert != "" { // our own certificate doubles as the client certificate stages with mTLS require
		identity, err := tls.LoadX509KeyPair(c.tlsCert, c.tlsKey)
		if err != nil {
			return nil, fmt.Errorf("cannot load --tls-cert/--tls-key: %v", err)
		}
		base.Certificates = []tls.Certificate{identity}
	}
	return func(address, serverName string) (*grpc.ClientConn, error) {
		config := base.Clone()
		config.ServerName = serverName // dialled by IP: verify the certificate against the name
		return grpc.Dial(address, append(options, grpc.WithTransportCredentials(credentials.NewTLS(config)))...)
	}, nil
}

func serverTLS(c *config) (*tls.Config, error) {
	identity, err := tls.LoadX509KeyPair(c.tlsCert, c.tlsKey)
	if err != nil {
		return nil, fmt.Errorf("cannot load --tls-cert/--tls-key: %v", err)
	}
	config := &tls.Config{Certificates: []tls.Certificate{identity}, MinVersion: tls.VersionTLS12}
	if c.requireClientCert {
		if config.ClientCAs, err = readPool(c.tlsCA); err != nil {
			return nil, err
		}
		config.ClientAuth = tls.RequireAndVerifyClientCert
	}
	return config, nil
}

func readPool(path string) (*x509.CertPool, error) {
	pem, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("cannot read the TLS CA %q: %v", path, err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("the TLS CA %q holds no PEM certificate", path)
	}
	return roots, nil
}

// readToken: the bearer token in a file (surrounding whitespace ignored).
func readToken(path string) (string, error) {
	content, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("cannot read the auth token file %q: %v", path, err)
	}
	token := strings.TrimSpace(string(content))
	if token == "" {
		return "", fmt.Errorf("the auth token file %q is empty", path)
	}
	return token, nil
}

// serveMetrics serves /metrics; the bound port, or nil when off.
func serveMetrics(c *config, m *metrics) (interface{}, error) {
	if c.metricsPort < 0 {
		return nil, nil
	}
	listener, err := net.Listen("tcp", net.JoinHostPort(c.host, strconv.Itoa(c.metricsPort)))
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", m)
	go func() {
		if err := http.Serve(listener, mux); err != nil && !errors.Is(err, net.ErrClosed) {
			log.Printf("ERROR metrics server: %v", err)
		}
	}()
	return listener.Addr().(*net.TCPAddr).Port, nil
}

// exitWithLauncher: in a service the launcher (epd up, tests) started, SIGTERM ourselves (a
// normal drain) once the launcher is gone, however it went. A no-op otherwise.
func exitWithLauncher() {
	launcher, err := strconv.Atoi(os.Getenv("EPD_LAUNCHER_PID"))
	if err != nil {
		return
	}
	for os.Getppid() == launcher {
		time.Sleep(500 * time.Millisecond)
	}
	log.Printf("WARNING the launcher (pid %d) is gone: stopping", launcher)
	syscall.Kill(os.Getpid(), syscall.SIGTERM)
}

// serviceName: a service's full name (its readiness name in the standard health service).
func serviceName(file protoreflect.FileDescriptor, name protoreflect.Name) string {
	return string(file.Services().ByName(name).FullName())
}
