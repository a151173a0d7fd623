package main

import (
	"container/list"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"log"
	"math"
	"math/rand"
	"net"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// A stage's instances, and which one takes each call.
//
// Picking: least in-flight first, round-robin on ties, instances known to serve before ones not
// yet heard from. Work a cache on the instance can reuse (an item's encoder output, a prompt
// prefix's KV) is picked by key (pickForKey): consistent hashing with bounded load, so a key
// keeps going to one instance, a hot key spills to the next on the ring, and an instance that
// joins or leaves moves only its own share. Where a repeat costs its holder next to nothing (an
// encoder answers an item its arena holds without its engine), the caller records who served a
// key (recordHolder) and the key goes back there past the load bound.
//
// Health: every instance's standard health service is watched (Watch on the stage's readiness
// name), so an instance that drains, loses its engine or dies leaves the rotation at once, and
// one restarted at the same address rejoins by itself. A call that fails with UNAVAILABLE
// ejects its instance until a health check says it serves: a kill -9 is seen on the first
// failed call, not after a probe period.
//
// Membership: instances are listed (host:port) or stand behind DNS names (dns:///name:port, a
// Kubernetes headless Service, say), resolved again every resolveInterval and after a failure.

type instanceHealth int

const (
	healthUnknown instanceHealth = iota // not heard from yet: usable, after instances known to serve
	healthServing
	healthDown // NOT_SERVING, unreachable, or its last call failed: never picked
)

const (
	// Consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam, 2016): an
	// instance takes a key only while its in-flight calls are under this factor times the mean.
	loadBound         = 1.25
	pointsPerInstance = 64    // virtual nodes: keys spread evenly even over two or three instances
	holdersKept       = 65536 // keys whose last server a pool remembers
	watchRetryMin     = 100 * time.Millisecond
	watchRetryMax     = time.Second
	checkTimeout      = 2 * time.Second
	resolveInterval   = 5 * time.Second
	dnsPrefix         = "dns:///"
)

type instance struct {
	address  string
	conn     *grpc.ClientConn
	health   instanceHealth
	inFlight int
	leaving  bool // no longer listed: no new work, dropped once its calls end
	stop     context.CancelFunc
}

type dnsName struct {
	host string
	port string
}

// dialFunc opens a channel to an instance; serverName is the name its certificate must carry
// when it is dialled by IP (a DNS name's instances), else "".
type dialFunc func(address, serverName string) (*grpc.ClientConn, error)

type pool struct {
	stage         string
	healthService string
	affinity      bool
	dial          dialFunc
	metrics       *metrics

	mu        sync.Mutex
	static    []string
	names     []dnsName
	resolved  map[dnsName][]string
	instances map[string]*instance
	order     []string // members in the order they joined: rotation and ring are stable
	ring      *hashRing
	holders   *holderCache
	turn      int
	// onAvailabilityChange runs (under no lock) when the pool gains its first live instance or
	// loses its last one: the gateway's readiness follows its stages.
	onAvailabilityChange func()
	resolveNow           chan struct{}
	ctx                  context.Context
	cancel               context.CancelFunc
}

func newPool(stage, healthService string, targets []string, dial dialFunc, affinity bool, m *metrics) (*pool, error) {
	if len(targets) == 0 {
		return nil, fmt.Errorf("no addresses for the %s stage", stage)
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &pool{
		stage: stage, healthService: healthService, affinity: affinity, dial: dial, metrics: m,
		resolved: map[dnsName][]string{}, instances: map[string]*instance{}, holders: newHolderCache(holdersKept),
		resolveNow: make(chan struct{}, 1), ctx: ctx, cancel: cancel,
	}
	for _, target := range targets {
		if !strings.HasPrefix(target, dnsPrefix) {
			p.static = append(p.static, target)
			continue
		}
		host, port, err := net.SplitHostPort(strings.TrimPrefix(target, dnsPrefix))
		if number, perr := strconv.Atoi(port); err != nil || perr != nil || host == "" || number <= 0 || number >= 65536 {
			cancel()
			return nil, fmt.Errorf("%q is not dns:///host:port", target)
		}
		p.names = append(p.names, dnsName{host, port})
	}
	for _, name := range p.names {
		if addresses, err := lookup(ctx, name); err != nil {
			log.Printf("WARNING %s: cannot resolve %s yet: %v", stage, name.host, err)
		} else {
			p.resolved[name] = addresses
		}
	}
	p.mu.Lock()
	err := p.setMembersLocked(p.wantedLocked())
	p.mu.Unlock()
	if err != nil {
		cancel()
		return nil, err
	}
	if len(p.names) > 0 {
		go p.resolveLoop()
	}
	return p, nil
}

// lookup: a name's instances, one per distinct IP.
func lookup(ctx context.Context, name dnsName) ([]string, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	ips, err := net.DefaultResolver.LookupHost(ctx, name.host)
	if err != nil {
		return nil, err
	}
	sort.Strings(ips)
	addresses := make([]string, 0, len(ips))
	for i, ip := range ips {
		if i == 0 || ip != ips[i-1] {
			addresses = append(addresses, net.JoinHostPort(ip, name.port))
		}
	}
	return addresses, nil
}

func (p *pool) close() {
	p.cancel()
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, in := range p.instances {
		in.conn.Close()
	}
}

// available: whether any instance may be picked (the gateway's readiness needs one per stage).
func (p *pool) available() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.availableLocked()
}

func (p *pool) availableLocked() bool {
	for _, address := range p.order {
		if in := p.instances[address]; !in.leaving && in.health != healthDown {
			return true
		}
	}
	return false
}

func (p *pool) membersLocked() []*instance {
	members := make([]*instance, 0, len(p.order))
	for _, address := range p.order {
		if in := p.instances[address]; !in.leaving {
			members = append(members, in)
		}
	}
	return members
}

func (p *pool) noLiveInstance(members int) *requestError {
	return &requestError{code: codes.Unavailable, message: fmt.Sprintf("no live %s instance (all %d are down or unreachable)", p.stage, members)}
}

// pick: the least-loaded live instance, preferring ones not in avoid (those that already failed
// this request) and ones known to serve; ties rotate, so idle instances share the work.
func (p *pool) pick(avoid map[string]bool) (string, *requestError) {
	p.mu.Lock()
	defer p.mu.Unlock()
	members := p.membersLocked()
	candidates := preferred(members, avoid)
	if len(candidates) == 0 {
		return "", p.noLiveInstance(len(members))
	}
	start := p.turn % len(candidates)
	p.turn++
	var best *instance
	for i := range candidates {
		in := candidates[(start+i)%len(candidates)]
		if best == nil || better(in, best) {
			best = in
		}
	}
	return best.address, nil
}

func better(a, b *instance) bool {
	aServing, bServing := a.health == healthServing, b.health == healthServing
	if aServing != bServing {
		return aServing
	}
	return a.inFlight < b.inFlight
}

// preferred: the live instances not in avoid, or every live one when all are to be avoided.
func preferred(members []*instance, avoid map[string]bool) []*instance {
	var live, fresh []*instance
	for _, in := range members {
		if in.health == healthDown {
			continue
		}
		live = append(live, in)
		if !avoid[in.address] {
			fresh = append(fresh, in)
		}
	}
	if len(fresh) > 0 {
		return fresh
	}
	return live
}

// pickForKey: the live instance recorded as the key's holder, whatever its load, while the
// key's ring owner is the one it had then; else the first live instance from the key's point on
// the ring whose load is within the bound: ones known to serve first, those in avoid only when
// no other is live. The owner check lets a joining instance take its share of keys, while a key
// that spilled past a busy owner stays with the instance whose cache holds it.
func (p *pool) pickForKey(key uint64, avoid map[string]bool) (string, *requestError) {
	p.mu.Lock()
	if p.ring == nil {
		p.mu.Unlock()
		return p.pick(avoid)
	}
	defer p.mu.Unlock()
	if held, ok := p.holders.get(key); ok && held.owner == p.ring.owner(key) && !avoid[held.address] {
		if in := p.instances[held.address]; in != nil && !in.leaving && in.health != healthDown {
			return held.address, nil
		}
	}
	walk := p.ring.walk(key)
	ordered := make([]*instance, 0, len(walk))
	for _, address := range walk {
		ordered = append(ordered, p.instances[address])
	}
	candidates := preferred(ordered, avoid)
	if len(candidates) == 0 {
		return "", p.noLiveInstance(len(ordered))
	}
	var serving []*instance
	for _, in := range candidates {
		if in.health == healthServing {
			serving = append(serving, in)
		}
	}
	if len(serving) > 0 {
		candidates = serving
	}
	load := 1
	for _, in := range candidates {
		load += in.inFlight
	}
	bound := int(math.Ceil(loadBound * float64(load) / float64(len(candidates))))
	for _, in := range candidates {
		if in.inFlight < bound {
			return in.address, nil
		}
	}
	return candidates[0].address, nil // unreachable: the bound exceeds the mean
}

// recordHolder: address served key, so pickForKey sends the key back there (only for work a
// holder repeats at next to no cost).
func (p *pool) recordHolder(key uint64, address string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ring != nil {
		p.holders.put(key, holder{address, p.ring.owner(key)})
	}
}

// acquire counts a call against an instance while it runs; release when the call is done.
func (p *pool) acquire(address string) (*grpc.ClientConn, func(), *requestError) {
	p.mu.Lock()
	defer p.mu.Unlock()
	in := p.instances[address]
	if in == nil {
		return nil, nil, &requestError{code: codes.Unavailable, message: fmt.Sprintf("%s %s is no longer an instance", p.stage, address),
			stage: p.stage, suspects: []string{address}}
	}
	in.inFlight++
	return in.conn, func() {
		p.mu.Lock()
		defer p.mu.Unlock()
		in.inFlight--
		if in.leaving && in.inFlight == 0 {
			p.dropLocked(in)
		}
	}, nil
}

// conn: an instance's channel, for calls outside the rotation (releases).
func (p *pool) conn(address string) *grpc.ClientConn {
	p.mu.Lock()
	defer p.mu.Unlock()
	if in := p.instances[address]; in != nil {
		return in.conn
	}
	return nil
}

// eject takes an instance whose call failed out of the rotation until a health check passes.
// The check runs at once: an instance that is fine (the failure was a peer's) is back within a
// round trip; a dead one stays out until its watch reconnects to a restarted process.
func (p *pool) eject(address, reason string) {
	p.mu.Lock()
	in := p.instances[address]
	if in == nil {
		p.mu.Unlock()
		return
	}
	if in.health != healthDown {
		log.Printf("WARNING %s %s ejected: %s", p.stage, address, reason)
		p.metrics.ejections.inc(p.stage)
	}
	changed := p.setHealthLocked(in, healthDown)
	conn := in.conn
	p.mu.Unlock()
	p.notify(changed)
	go p.check(address, conn)
	select {
	case p.resolveNow <- struct{}{}:
	default:
	}
}

func (p *pool) notify(changed bool) {
	if changed && p.onAvailabilityChange != nil {
		p.onAvailabilityChange()
	}
}

// setHealthLocked records an instance's health; whether the pool's availability changed.
func (p *pool) setHealthLocked(in *instance, state instanceHealth) bool {
	if in.leaving || p.instances[in.address] != in {
		return false // it left the pool meanwhile
	}
	was := p.availableLocked()
	if in.health == healthDown && state == healthServing {
		log.Printf("INFO %s %s is serving again", p.stage, in.address)
	}
	in.health = state
	p.metrics.instanceUp.set(state != healthDown, p.stage, in.address)
	return p.availableLocked() != was
}

func (p *pool) setHealth(in *instance, state instanceHealth) {
	p.mu.Lock()
	changed := p.setHealthLocked(in, state)
	p.mu.Unlock()
	p.notify(changed)
}

func (p *pool) check(address string, conn *grpc.ClientConn) {
	ctx, cancel := context.WithTimeout(p.ctx, checkTimeout)
	defer cancel()
	response, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: p.healthService})
	if err != nil {
		return // still down; the watch brings it back when it returns
	}
	p.mu.Lock()
	in := p.instances[address]
	p.mu.Unlock()
	if in != nil {
		p.setHealth(in, healthOf(response.GetStatus()))
	}
}

func healthOf(status healthpb.HealthCheckResponse_ServingStatus) instanceHealth {
	if status == healthpb.HealthCheckResponse_SERVING {
		return healthServing
	}
	return healthDown
}

// watch follows an instance's health until it leaves the pool: the stream ending means the
// instance stopped or became unreachable, and it is watched again with a growing pause.
func (p *pool) watch(ctx context.Context, in *instance) {
	client := healthpb.NewHealthClient(in.conn)
	pause := watchRetryMin
	for ctx.Err() == nil {
		stream, err := client.Watch(ctx, &healthpb.HealthCheckRequest{Service: p.healthService})
		for err == nil {
			var response *healthpb.HealthCheckResponse
			if response, err = stream.Recv(); err == nil {
				pause = watchRetryMin
				p.setHealth(in, healthOf(response.GetStatus()))
			}
		}
		if ctx.Err() != nil {
			return
		}
		p.setHealth(in, healthDown)
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Duration(float64(pause) * (0.5 + 0.5*rand.Float64()))):
		}
		if pause *= 2; pause > watchRetryMax {
			pause = watchRetryMax
		}
	}
}

// ---- membership ----------------------------------------------------------------------------

func (p *pool) wantedLocked() []string {
	seen := map[string]bool{}
	var wanted []string
	add := func(address string) {
		if !seen[address] {
			seen[address] = true
			wanted = append(wanted, address)
		}
	}
	for _, address := range p.static {
		add(address)
	}
	for _, name := range p.names {
		for _, address := range p.resolved[name] {
			add(address)
		}
	}
	return wanted
}

func (p *pool) serverNameLocked(address string) string {
	for name, addresses := range p.resolved {
		for _, listed := range addresses {
			if listed == address {
				return name.host
			}
		}
	}
	return ""
}

func (p *pool) setMembersLocked(wanted []string) error {
	isWanted := map[string]bool{}
	for _, address := range wanted {
		isWanted[address] = true
		in := p.instances[address]
		switch {
		case in == nil:
			conn, err := p.dial(address, p.serverNameLocked(address))
			if err != nil {
				return fmt.Errorf("%s %s: %v", p.stage, address, err)
			}
			in = &instance{address: address, conn: conn}
			p.instances[address] = in
			p.order = append(p.order, address)
			p.admitLocked(in)
		case in.leaving: // listed again before its last call ended
			in.leaving = false
			p.admitLocked(in)
		}
	}
	for _, address := range p.order {
		if in := p.instances[address]; !in.leaving && !isWanted[address] {
			log.Printf("INFO %s %s left (no longer listed)", p.stage, address)
			in.leaving = true
			in.stop()
			p.metrics.instanceUp.remove(p.stage, address)
			if in.inFlight == 0 {
				p.dropLocked(in)
			}
		}
	}
	p.ring = nil
	if members := p.membersLocked(); p.affinity && len(members) > 0 {
		p.ring = newHashRing(members)
	}
	return nil
}

func (p *pool) admitLocked(in *instance) {
	in.health = healthUnknown
	p.metrics.instanceUp.set(true, p.stage, in.address)
	ctx, stop := context.WithCancel(p.ctx)
	in.stop = stop
	go p.watch(ctx, in)
}

func (p *pool) dropLocked(in *instance) {
	delete(p.instances, in.address)
	for i, address := range p.order {
		if address == in.address {
			p.order = append(p.order[:i:i], p.order[i+1:]...)
			break
		}
	}
	go in.conn.Close()
}

func (p *pool) resolveLoop() {
	timer := time.NewTicker(resolveInterval)
	defer timer.Stop()
	for {
		select {
		case <-p.ctx.Done():
			return
		case <-timer.C:
		case <-p.resolveNow:
		}
		for _, name := range p.names {
			addresses, err := lookup(p.ctx, name)
			if err != nil { // keep the last answer: a DNS hiccup must not empty the pool
				log.Printf("WARNING %s: cannot resolve %s: %v", p.stage, name.host, err)
				continue
			}
			p.mu.Lock()
			p.resolved[name] = addresses
			p.mu.Unlock()
		}
		p.mu.Lock()
		was := p.availableLocked()
		if err := p.setMembersLocked(p.wantedLocked()); err != nil {
			log.Printf("ERROR %s: could not apply the resolved members: %v", p.stage, err)
		}
		changed := p.availableLocked() != was
		p.mu.Unlock()
		p.notify(changed)
	}
}

// ---- the ring ------------------------------------------------------------------------------

// hashRing: where each key lands among a set of instances; instances come and go without
// moving other instances' keys.
type hashRing struct {
	points []uint64
	owners []string
}

func newHashRing(members []*instance) *hashRing {
	type point struct {
		hash  uint64
		owner string
	}
	points := make([]point, 0, len(members)*pointsPerInstance)
	for _, in := range members {
		for i := 0; i < pointsPerInstance; i++ {
			// A cryptographic digest: FNV's points for "host:port#i" bunch together (one of three
			// instances owned 12 % of the keys), and the ring is built only when members change.
			digest := sha256.Sum256([]byte(fmt.Sprintf("%s#%d", in.address, i)))
			points = append(points, point{keyOf(digest[:]), in.address})
		}
	}
	sort.Slice(points, func(i, j int) bool { return points[i].hash < points[j].hash })
	ring := &hashRing{points: make([]uint64, len(points)), owners: make([]string, len(points))}
	for i, pt := range points {
		ring.points[i], ring.owners[i] = pt.hash, pt.owner
	}
	return ring
}

// owner: the instance at the key's point.
func (r *hashRing) owner(key uint64) string { return r.owners[r.start(key)] }

func (r *hashRing) start(key uint64) int {
	return sort.Search(len(r.points), func(i int) bool { return r.points[i] > key }) % len(r.points)
}

// walk: every instance once, in ring order from the key's point.
func (r *hashRing) walk(key uint64) []string {
	start := r.start(key)
	seen := map[string]bool{}
	var order []string
	for i := 0; i < len(r.owners); i++ {
		owner := r.owners[(start+i)%len(r.owners)]
		if !seen[owner] {
			seen[owner] = true
			order = append(order, owner)
		}
	}
	return order
}

// ---- holders -------------------------------------------------------------------------------

type holder struct {
	address string
	owner   string // the key's ring owner when it was recorded
}

// holderCache remembers the last server of the most recently served keys (an LRU).
type holderCache struct {
	limit int
	byKey map[uint64]*list.Element
	order *list.List // of *heldKey, least recently recorded first
}

type heldKey struct {
	key uint64
	holder
}

func newHolderCache(limit int) *holderCache {
	return &holderCache{limit: limit, byKey: map[uint64]*list.Element{}, order: list.New()}
}

func (c *holderCache) get(key uint64) (holder, bool) {
	if element, ok := c.byKey[key]; ok {
		return element.Value.(*heldKey).holder, true
	}
	return holder{}, false
}

func (c *holderCache) put(key uint64, h holder) {
	if element, ok := c.byKey[key]; ok {
		element.Value.(*heldKey).holder = h
		c.order.MoveToBack(element)
		return
	}
	c.byKey[key] = c.order.PushBack(&heldKey{key, h})
	if c.order.Len() > c.limit {
		oldest := c.order.Remove(c.order.Front()).(*heldKey)
		delete(c.byKey, oldest.key)
	}
}

// keyOf reads a ring position from a keyed digest.
func keyOf(digest []byte) uint64 { return binary.BigEndian.Uint64(digest[:8]) }
